"""One device: the model runner (executor) and the sampler."""

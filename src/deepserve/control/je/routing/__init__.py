"""Which TE serves a job, as pure objects with no sockets (DeepServe Algorithm 1:
router + global prompt index, PD policy from its heatmap and decode-length
predictor; DualPath's two-level scheduler). The job executor and the tools'
simulators and profilers use them."""

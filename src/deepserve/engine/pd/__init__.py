"""Prefill/decode disaggregation, the master's part (protocol: messages/pd.py):
pure policy objects that return effects for the master to carry out."""

"""The TE as processes: master, tokenizer actor, the launcher that starts
them with the workers, te_server (a TE serving a node), a pre-warmed pod,
the master's report, and the caller's client of a process-mode TE."""

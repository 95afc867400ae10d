"""Control plane (floor 4), in two rooms:

    je/          the job executor's process: request -> job -> task(s), its books
                 (models, suspects, turns, contexts) and its TE links
      routing/   the pure policies it consults (DeepServe Algorithm 1: router,
                 global prompt index, PD policy; DualPath's scheduler)
    cm/          the cluster manager's process: TE registry, TE-list push, autoscaler

Talks to engines only by messages (messages/control.py); never imports
deepserve.engine, deepserve.worker or deepserve.model.
"""

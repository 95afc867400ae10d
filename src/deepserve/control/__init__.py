"""Control plane (floor 4): job executor, routing, cluster manager, autoscaler.

Talks to engines only by messages (messages/control.py); never imports
deepserve.engine, deepserve.worker or deepserve.model.
"""

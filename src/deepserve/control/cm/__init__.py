"""The cluster manager (`python -m deepserve.control.cm.cluster_manager`): the TE
registry and TE-list broadcast, and the autoscaler it runs (scaling.py over the
pure policy of autoscaler.py)."""

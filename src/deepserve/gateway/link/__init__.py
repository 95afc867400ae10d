"""The gateway's ZeroMQ side: the JobClient's sockets to the JE and the CM, the
JE's incarnations (JELink), the view of the TEs (ClusterView), the open
sub-requests' routes and the ReplyStream each HTTP request reads."""

"""The job executor (`python -m deepserve.control.je.job_executor`): requests
become jobs and tasks sent to TEs; what it keeps per request (tasks, suspects,
turns, contexts, models) lives beside it. It routes through control/je/routing/."""

"""Fault-injection drills: load with every request accounted (load.py) and the
verdict (report.py): completed / failed / lost, bad streams, detect and
recover times."""

from deepserve.drill.load import (COMPLETED, FAILED, LOST, LoadDriver, RequestRecord,
                                  first_success_after, run_load)
from deepserve.drill.report import KEYS, DrillReport, bad_reason, build_report

__all__ = ["COMPLETED", "FAILED", "KEYS", "LOST", "DrillReport", "LoadDriver", "RequestRecord",
           "bad_reason", "build_report", "first_success_after", "run_load"]

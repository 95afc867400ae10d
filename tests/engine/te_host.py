"""A host process for lifecycle tests: start a process-mode TE, print its pids
and run id as one JSON line, then keep it busy until signalled.

    python -m tests.engine.te_host MODEL_DIR [--no-handler]
"""

import json
import signal
import sys

from deepserve import LLM, SamplingParams


def main() -> None:
    if "--no-handler" not in sys.argv:
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(143))
    with LLM(sys.argv[1], processes=True, num_kv_blocks=64, startup_timeout_s=90) as llm:
        launcher = llm.client.launcher
        print(json.dumps({"pids": launcher.pids, "run_id": launcher.run_id,
                          "run_dir": str(launcher.run_dir)}), flush=True)
        while True:
            llm.generate("while True:", SamplingParams(max_tokens=50, ignore_eos=True))


if __name__ == "__main__":
    main()

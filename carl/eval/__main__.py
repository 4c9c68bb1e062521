"""``python -m carl.eval``: the ``carl-eval`` command (:mod:`carl.eval.cli`)."""
import os

from carl.eval.cli import main

if __name__ == "__main__":
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    main()

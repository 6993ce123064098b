"""The kill command of the mutation job: the conformance suite alone, quick mode.

Run by cosmic-ray once per mutant (``test-command`` in the generated config),
from the job's copy of the repository with ``PYTHONPATH`` pointing at that
copy, so the mutated ``kvfast``/``kvref`` are the ones imported::

    python tools/mutation/kill.py --kv-backend=kvfast

Exit status 0 means every test passed (the mutant survived). Hypothesis runs
without its example database (a failure found for one mutant must not be
replayed for the next) and derandomized (the same examples on every run, so a
score is reproducible); ``--random`` draws fresh examples instead.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from hypothesis import settings

    derandomize = "--random" not in argv
    argv = [a for a in argv if a != "--random"]
    settings.register_profile("kvcache-mutation", database=None, derandomize=derandomize)
    settings.load_profile("kvcache-mutation")
    import pytest

    args = ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--pyargs", "kvspec.conformance",
            "--kv-quick", "--kv-no-shrink", *argv]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

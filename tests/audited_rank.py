"""A rank's program under the collective audit: ``python tests/audited_rank.py PROGRAM ARGS...`` installs the audit
(:mod:`tests.collective_audit`) and runs PROGRAM (a script's path, or a module such as ``diloco.cli``) as
``__main__`` with ARGS, as the rank would have run it.  The launchers of ``tests/conftest.py`` put it in front of
every rank they start while the audit is on."""

from __future__ import annotations

import runpy
import sys
import warnings
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.collective_audit import install

    install()
    program, sys.argv = sys.argv[1], sys.argv[1:]
    if program.endswith(".py"):
        runpy.run_path(program, run_name="__main__")
    else:
        with warnings.catch_warnings():  # that the module is in sys.modules already: a warm fork server preloaded it
            warnings.filterwarnings("ignore", f"'{program}' found in sys.modules", RuntimeWarning)
            runpy.run_module(program, run_name="__main__", alter_sys=True)

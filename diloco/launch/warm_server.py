"""The last thing the warm fork server imports (:data:`diloco.launch.warm.PRELOAD`): importing this module readies
the server's memory for the islands it forks.  multiprocessing gives a fork server module names to import and
nothing else, so the work is done at import, once, in the server alone.

- **One torch shared-memory manager for every island.**  hivemind sets torch's sharing strategy to
  ``file_system``, and every hivemind future shares a few bytes between an island and its DHT process, so torch
  starts a ``torch_shm_manager`` daemon in each island: a process of its own that loads libtorch, about 60 MB
  that no two islands share (measured: 63 MB of PSS each).  A process whose parent had started one uses the
  parent's, so the server starts one here and every island forked from it registers its segments there.  The
  manager unlinks what a client leaves behind when the client's connection closes, and the islands share the
  server's connection: what a killed island leaves in ``/dev/shm`` (a page per few hundred DHT calls) is removed
  when the server and its last island have exited.
"""

from __future__ import annotations

import warnings

import torch

# an island forked from the server first runs its driver's main module again, as __mp_main__ (multiprocessing does,
# for a driver started as `python -m diloco.cli`), which the server imported already: runpy's warning that it did,
# once per island on the driver's terminal, tells a user nothing
warnings.filterwarnings("ignore", r"'diloco\.cli' found in sys\.modules", RuntimeWarning)

# starts the manager; the server keeps its connection (torch's, process-wide) after the byte is freed
torch.empty(1, dtype=torch.uint8).share_memory_()

"""Multi-process training: process layout (:mod:`.context`), launch checks (:mod:`.launch`) and the gradient
sync methods (:func:`make_sync`). See ``docs/distributed.md``."""
from carl.parallel.base import SyncMethod
from carl.parallel.context import DistContext, DistributedError, init_distributed
from carl.parallel.sync import SYNC_METHODS, make_sync

__all__ = ["SYNC_METHODS", "DistContext", "DistributedError", "SyncMethod", "init_distributed", "make_sync"]

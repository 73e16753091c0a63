"""DynamicBatchLoader, by concern (the class itself is the trainer-facing iterator; the rest is what it delegates).

- loader.py -- DynamicBatchLoader: epochs, the iterator, close/with, state_dict/load_state_dict
- config.py -- LoaderConfig (frozen, one part per concern) from the flat keywords, checked in the order a user hits them
- state.py  -- a saved state checked against this loader and turned into the epoch to resume (resizes: ../redeal.py)
- keys.py   -- the keys of an epoch's samples (dataset index, stream position, carried (epoch, index)) as streams
- idle.py   -- the placeholder sample an IDLE batch collates
"""

from .config import LoaderConfig
from .loader import DynamicBatchLoader
from .state import STATE_VERSION

__all__ = ["DynamicBatchLoader", "LoaderConfig", "STATE_VERSION"]

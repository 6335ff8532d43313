"""Mixed precision: default lists (``lists``) and the ``precision`` pass (``amp``)."""
from . import amp as _amp  # noqa: F401  (registers the "precision" pass)
from .amp import MODES, PrecisionPass, canonical_mode  # noqa: F401

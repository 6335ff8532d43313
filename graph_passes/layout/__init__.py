"""Layout pass family: NC1HWC0 ("5HD") / FRACTAL_Z formats, the ``layout``
pass (registered on import) and the alignment analysis behind ``check_align``."""
from . import align, formats, op_lists  # noqa: F401
from . import layout_pass  # noqa: F401  (registers "layout")
from .layout_pass import LayoutPass, transdata_counts  # noqa: F401

"""``python -m adaattn``: prints :func:`adaattn.show_config`."""
from . import show_config

show_config()

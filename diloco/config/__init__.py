"""The configuration: one typed tree (:mod:`diloco.config.schema`), read from TOML and the command line
(:mod:`diloco.config.loader`) and checked as a whole (:mod:`diloco.config.checks`)."""

from diloco.config.schema import *  # noqa: F401,F403
from diloco.config.schema import __all__  # noqa: F401

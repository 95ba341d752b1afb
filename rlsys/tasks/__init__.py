"""The example tasks: importing the package registers their rewards (`arith`, `calc`, `extremes`) and the calculator."""

from rlsys.tasks import arith, calc, extremes  # noqa: F401

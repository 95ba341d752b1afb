"""The example tasks: importing the package registers their rewards (`arith`, `calc`, `counting`, `extremes`) and the calculator."""

from rlsys.tasks import arith, calc, counting, extremes  # noqa: F401

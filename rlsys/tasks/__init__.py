"""The example tasks: importing the package registers their rewards (`arith`, `calc`) and the calculator."""

from rlsys.tasks import arith, calc  # noqa: F401

import rlrecipe  # noqa: F401 - first, so that torch loads OpenMP with the package's wait policy

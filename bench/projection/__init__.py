"""The projection stack: a step-level simulator of a rollout engine (sim.py), the cost model fitted
to measured step times (calibration.py), the C3PO++ rollout projection (rollout.py) and the
asynchronous-RL projection at the 7B recipe (asynchronous.py). Each is run as a module
(`python -m bench.projection.rollout`, `python -m bench.projection.asynchronous`); tests and the
other benchmarks import the public names of each module, never its underscored helpers."""

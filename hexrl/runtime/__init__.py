"""What every rank of a run shares around its role's loop: the rank's context, node placement, CPU
affinity, the watchdog, the collective rules, the effective config and the run directory's files
(the input checks before any process group exists are hexrl/preflight.py). Import from the submodule
you need."""

"""What every rank of a run shares around its role's loop: the rank's context, the input checks
before any process group exists, node placement, CPU affinity, the watchdog, the collective rules,
the effective config and the run directory's files. Import from the submodule you need."""

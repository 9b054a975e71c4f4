"""The studies: learning and staleness runs, plan quality, the paper table, the mutation audit."""

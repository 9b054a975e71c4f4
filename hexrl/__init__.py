"""hexrl: asynchronous GRPO on heterogeneous GPU clusters."""

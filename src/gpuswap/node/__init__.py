"""The node side: daemon, controller, supervisors, GPU inventory, durable state."""

"""The `opfuse` CLI's commands, one module per group (client.cli assembles them into one app)."""

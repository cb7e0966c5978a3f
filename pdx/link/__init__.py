"""Link probing: probe server and client, statistics, verdict rules."""

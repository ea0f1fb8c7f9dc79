"""What people would rather see than read: tables and plots of finished runs (metrics.jsonl, loss curves)."""

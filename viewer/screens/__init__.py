"""Screens of hsnap-view: one snapshot (main), two snapshots (diff), help, error."""

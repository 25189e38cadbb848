"""Widgets of hsnap-view; each takes its data as attributes and posts messages up."""

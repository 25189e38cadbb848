"""hsnap's tools: the `hsnap` command line, diff, stats, `.npy` export and the viewer's formatting helpers.

The top layer of hsnap_format: tools import the format core and the stores; nothing in the core imports a tool.
Subcommands of other packages (the SGLang plug-in's clients, the demo) register through the `hsnap.commands`
entry-point group, so this package never names them.
"""

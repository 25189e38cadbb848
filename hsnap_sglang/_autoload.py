"""``torch.backends`` entry point (torch's out-of-tree extension autoload, run at the end of ``import torch``).

It is the earliest seam that runs in every Python process of an SGLang server, before any SGLang module: SGLang's
own plug-in hook (``load_plugins``) runs only after its modules are imported, too late for the ``sgl_kernel``
imports made under ``if _is_cpu:`` at module level.  Without ``HSNAP_SGLANG_CPU=1`` it returns at once, importing
nothing (torch calls it in every process of this environment).  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` disables it;
:func:`hsnap_sglang.cpu.activate` is then the explicit way in.
"""

import os


def torch_autoload() -> None:
    if os.environ.get("HSNAP_SGLANG_CPU") != "1":
        return
    from hsnap_sglang.cpu import install

    install()

"""raas tool server: runs inside a sandbox and serves bash, ipython, editor and files over a Unix socket.

Kept importable on Python >= 3.8 with only the standard library (``jupyter_client`` when the image
has it), because it runs on the sandbox image's own ``python3``.
"""

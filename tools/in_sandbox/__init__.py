"""The in-sandbox tool server (`server.py`) and how it runs a call's process (`procs.py`).

Both run inside the sandbox, on the image's Python 3 (3.8 or newer), and import only the standard
library: the host sends their text as the program of `python3 -c` (`reflow.sandbox.channel`), so the
image holds no ReFlow code. The host's side of the protocol is `reflow.sandbox.channel`.
"""

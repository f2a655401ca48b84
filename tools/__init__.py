"""The tools a model calls in a sandbox (run_python, run_shell, file tools), as the server that runs them
there: `reflow_tools.in_sandbox`. Standard library only; nothing here runs on the host."""

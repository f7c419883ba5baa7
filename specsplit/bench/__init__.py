"""The measuring commands: `bench` (and its anchors: transformers, llama.cpp, llama-server),
`bench --ceiling/--traffic/--long-context`, `validate`, `calibrate`, `soak`, `topology` and the
trace reports. They start stacks (specsplit.launcher) and read what the services report; the
services and the runtime library never import from here."""

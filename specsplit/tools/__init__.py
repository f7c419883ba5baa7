"""Tools around the services (benchmarks, calibration, trace analysis, distillation, the local
launcher); the services and the runtime library never import from here."""

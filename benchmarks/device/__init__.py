"""The one device run (``benchmarks/device/run.sh``): its report, its sections' figures, and the offline set-up."""

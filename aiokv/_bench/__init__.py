"""The benchmarks behind ``aiokv bench``: each prints ratios against a raw baseline
measured in the same run. Private: nothing here is part of the public API."""

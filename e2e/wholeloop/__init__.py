"""The whole loop on one machine: a local control plane, the operator under the Helm chart's
ServiceAccount, engine pods made real by the local pod runtime, and load in phases; the checks
and the timeline plot. The script is e2e/whole_loop.py; the CI test is tests/e2e/test_whole_loop.py."""

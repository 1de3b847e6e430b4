"""The replica model: one engine replica run on a fitted step profile instead of a model (the real
LLMEngine, Scheduler and BlockManager on a simulated clock), and the planner that asks it which
replica count meets latency targets. The simulator (iterserve.simulate) runs fleets of these; the
operator's SLO policy runs the planner. It imports neither of them, so both can import it.
"""

"""`python -m agent_infer.core`: the engine core process (started by `CoreProcess.start`)."""

from agent_infer.core.process import core_main

core_main()

"""torch's own pipelining tests, adapted to CPU/gloo and run with torch's schedule classes
and with ScheduleRRFP given the same schedule as hint (see ``harness``)."""

"""Per-operator sharding, the reading room: capture a module's operators on `meta` (capture.py) and ask DTensor
which placements each can run with (strategies.py, the one module that touches DTensor's private rules).
They read the model, never run it. Costs live in plait.cost.operators, the solver kernel in
plait.search.sharding, the application in plait.execute.operators; planner.py runs capture, strategies, costs and
the kernel in order and writes the Plan's OperatorSharding (solution.py). The planner (spec, cost, search) stays
free of torch: what needs torch to plan per operator lives here."""

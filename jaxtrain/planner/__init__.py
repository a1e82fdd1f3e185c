from jaxtrain.planner.estimate import estimate, plan_report  # noqa: F401 - the package API

"""The search: one optuna study per problem, its trial loop, storage and re-time, and the database write."""

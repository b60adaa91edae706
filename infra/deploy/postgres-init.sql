-- Run once by the postgres image when its data volume is empty (compose.yaml, k8s/postgres.yaml):
-- MLflow's backend store gets a database of its own next to rtrl's store (database rtrl).
CREATE DATABASE mlflow OWNER rtrl;

#!/bin/sh
# Run once by the postgres image when its data volume is empty (compose.yaml; k8s/postgres.yaml
# carries the same script). POSTGRES_USER (rtrl) owns the store (database rtrl); the Job
# rtrl-migrate creates its tables as that owner. Least privilege (docs/security.md, Least
# privilege in the manifests):
# - each rtrl component that uses the store has a role of its own (rtrl_gateway, rtrl_labeler,
#   rtrl_worker, rtrl_reconciler): it may connect to rtrl and read and write the rows of the
#   tables the owner creates, never create, alter or drop a table, nor connect to MLflow's
#   databases;
# - MLflow's server has its own role (mlflow) owning its databases: runs and versions (mlflow)
#   and its users (mlflow_auth), which no rtrl role may connect to.
# Passwords come from the environment (DB_<ROLE>_PASSWORD, from the infra Secret or .env).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v gateway="$DB_GATEWAY_PASSWORD" \
  -v labeler="$DB_LABELER_PASSWORD" \
  -v worker="$DB_WORKER_PASSWORD" \
  -v reconciler="$DB_RECONCILER_PASSWORD" \
  -v mlflow="$DB_MLFLOW_PASSWORD" <<'SQL'
CREATE ROLE rtrl_gateway LOGIN PASSWORD :'gateway';
CREATE ROLE rtrl_labeler LOGIN PASSWORD :'labeler';
CREATE ROLE rtrl_worker LOGIN PASSWORD :'worker';
CREATE ROLE rtrl_reconciler LOGIN PASSWORD :'reconciler';
REVOKE ALL ON DATABASE rtrl FROM PUBLIC;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE rtrl TO rtrl_gateway, rtrl_labeler, rtrl_worker, rtrl_reconciler;
GRANT USAGE ON SCHEMA public TO rtrl_gateway, rtrl_labeler, rtrl_worker, rtrl_reconciler;
-- The tables do not exist yet: what the owner creates later is readable and writable by the roles.
ALTER DEFAULT PRIVILEGES FOR ROLE rtrl IN SCHEMA public
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO rtrl_gateway, rtrl_labeler, rtrl_worker, rtrl_reconciler;
ALTER DEFAULT PRIVILEGES FOR ROLE rtrl IN SCHEMA public
  GRANT USAGE, SELECT ON SEQUENCES TO rtrl_gateway, rtrl_labeler, rtrl_worker, rtrl_reconciler;

CREATE ROLE mlflow LOGIN PASSWORD :'mlflow';
CREATE DATABASE mlflow OWNER mlflow;
CREATE DATABASE mlflow_auth OWNER mlflow;
REVOKE ALL ON DATABASE mlflow, mlflow_auth FROM PUBLIC;
SQL

BEGIN TRANSACTION;
CREATE TABLE bandwidths (
    field TEXT PRIMARY KEY,
    bytes_per_s REAL NOT NULL,
    samples INTEGER NOT NULL,
    updated REAL NOT NULL
);
INSERT INTO "bandwidths" VALUES('disk_write',1500000000.0,3,1.76400006112345600125e+09);
INSERT INTO "bandwidths" VALUES('ram_read',22500000000.0,1,1.76400006212345600124e+09);
CREATE TABLE decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    detail TEXT NOT NULL
);
INSERT INTO "decisions" VALUES(1,1.76400005012345600127e+09,'preempt',3,'{"gpus": [0], "why": "decision 0", "score": 0.0}');
INSERT INTO "decisions" VALUES(2,1.76400005112345600131e+09,'start',2,'{"gpus": [0], "why": "decision 1", "score": 0.25}');
INSERT INTO "decisions" VALUES(3,1.7640000521234560013e+09,'spill',4,'{"gpus": [0], "why": "decision 2", "score": 0.5}');
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    time REAL NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL,
    initiator TEXT          -- who asked for a pause or spill: 'policy' | 'user' (NULL otherwise)
);
INSERT INTO "events" VALUES(1,1,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(2,2,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(3,3,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(4,4,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(5,5,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(6,6,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(7,7,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(8,8,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(9,9,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(10,10,1.76400000012345600126e+09,'PENDING','submitted',NULL);
INSERT INTO "events" VALUES(12,2,1.76400000212345600125e+09,'RUNNING','started on GPU 0',NULL);
INSERT INTO "events" VALUES(13,3,1.76400000312345600129e+09,'RUNNING','started on GPU 1',NULL);
INSERT INTO "events" VALUES(14,4,1.76400000412345600133e+09,'RUNNING','started on GPU 0',NULL);
INSERT INTO "events" VALUES(15,5,1.76400000512345600132e+09,'RUNNING','started on GPU 1',NULL);
INSERT INTO "events" VALUES(16,6,1.76400000612345600123e+09,'RUNNING','started on GPU 0',NULL);
INSERT INTO "events" VALUES(17,7,1.76400000712345600122e+09,'RUNNING','started on GPU 1',NULL);
INSERT INTO "events" VALUES(18,8,1.76400000812345600126e+09,'RUNNING','started on GPU 0',NULL);
INSERT INTO "events" VALUES(19,9,1.7640000091234560013e+09,'RUNNING','started on GPU 1',NULL);
INSERT INTO "events" VALUES(20,10,1.76400001012345600129e+09,'RUNNING','started on GPU 0',NULL);
INSERT INTO "events" VALUES(22,2,1.76400002012345600123e+09,'RUNNING','ranks agreed',NULL);
INSERT INTO "events" VALUES(23,3,1.76400002112345600123e+09,'PAUSING','pausing to ram: the policy''s choice','policy');
INSERT INTO "events" VALUES(24,3,1.76400002212345600126e+09,'PAUSED','parked in RAM at step 1200',NULL);
INSERT INTO "events" VALUES(25,4,1.7640000231234560013e+09,'PAUSING','pausing to disk: requested by user','user');
INSERT INTO "events" VALUES(26,4,1.7640000241234560013e+09,'PAUSED','parked on disk',NULL);
INSERT INTO "events" VALUES(27,5,1.76400002512345600129e+09,'PAUSED','no gpuswap runtime: stopped (SIGSTOP)',NULL);
INSERT INTO "events" VALUES(28,6,1.76400002612345600133e+09,'PAUSING','pausing to ram: requested by user','user');
INSERT INTO "events" VALUES(29,7,1.76400002712345600123e+09,'PAUSED','pausing to ram',NULL);
INSERT INTO "events" VALUES(30,7,1.76400002812345600127e+09,'RESUMING','resuming on GPU 1',NULL);
INSERT INTO "events" VALUES(31,8,1.76400002912345600127e+09,'COMPLETED','exited with code 0',NULL);
INSERT INTO "events" VALUES(32,9,1.76400003012345600126e+09,'FAILED','killed by signal 9',NULL);
INSERT INTO "events" VALUES(33,10,1.7640000311234560013e+09,'CANCELLED','cancelled by alice',NULL);
INSERT INTO "events" VALUES(35,1,1.76400004012345600133e+09,'PENDING','waiting: 2 GPUs busy (jobs 2, 3)',NULL);
CREATE TABLE job_specs (
    job_id INTEGER PRIMARY KEY,
    argv_bytes INTEGER NOT NULL,
    argv TEXT NOT NULL,
    env TEXT
);
INSERT INTO "job_specs" VALUES(1,86,'["python", "train.py", "--lr", "3e-4", "h\u00e9llo w\u00f6rld \u2713", "a\nb", "it''s"]','{"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "NOTE": "\u00fcn\u00efcode \u2713"}');
INSERT INTO "job_specs" VALUES(2,47,'["torchrun", "--nproc-per-node", "2", "ddp.py"]','{"PATH": "/usr/bin"}');
INSERT INTO "job_specs" VALUES(3,18,'["python", "a.py"]','{"SEED": "1"}');
INSERT INTO "job_specs" VALUES(4,18,'["python", "b.py"]','{}');
INSERT INTO "job_specs" VALUES(5,15,'["./legacy.sh"]','{"X": "1"}');
INSERT INTO "job_specs" VALUES(6,18,'["python", "c.py"]','{}');
INSERT INTO "job_specs" VALUES(7,18,'["python", "d.py"]','{}');
INSERT INTO "job_specs" VALUES(8,8,'["true"]',NULL);
INSERT INTO "job_specs" VALUES(9,20,'["python", "oom.py"]',NULL);
INSERT INTO "job_specs" VALUES(10,17,'["sleep", "1000"]',NULL);
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    cwd TEXT NOT NULL,
    priority INTEGER NOT NULL,
    gpus INTEGER NOT NULL,
    mem_bytes INTEGER NOT NULL,
    preemptible INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    exit_code INTEGER,
    signal INTEGER,
    submit_time REAL NOT NULL,
    state_since REAL NOT NULL,
    last_start REAL,
    end_time REAL,
    attained_gpu_s REAL NOT NULL DEFAULT 0,
    run_s REAL NOT NULL DEFAULT 0,
    switch_s REAL NOT NULL DEFAULT 0,
    assigned TEXT NOT NULL DEFAULT '[]',
    home_gpus TEXT NOT NULL DEFAULT '[]',
    parked TEXT,
    parked_bytes INTEGER NOT NULL DEFAULT 0,
    device_bytes INTEGER NOT NULL DEFAULT 0,
    generation INTEGER NOT NULL DEFAULT 0,
    desired TEXT NOT NULL DEFAULT 'running',
    desired_tier TEXT,
    pause_requested_at REAL,
    hold INTEGER NOT NULL DEFAULT 0,
    no_runtime INTEGER NOT NULL DEFAULT 0,
    stopped INTEGER NOT NULL DEFAULT 0,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    preemptions INTEGER NOT NULL DEFAULT 0,
    step INTEGER,
    pause_mode TEXT NOT NULL DEFAULT 'auto',
    mechanism TEXT,
    attached INTEGER NOT NULL DEFAULT 0,
    transparent_refused TEXT,
    abort_reason TEXT,
    ram_allowance INTEGER,
    residue TEXT NOT NULL DEFAULT '{}',
    ranks TEXT NOT NULL DEFAULT '[]',
    version INTEGER NOT NULL DEFAULT 0,
    width INTEGER NOT NULL DEFAULT 1,
    ram_refusal TEXT
);
INSERT INTO "jobs" VALUES(1,'queued','alice',1001,1001,'/home/alice/exp',3,1,6442450944,1,'PENDING','held by alice',NULL,NULL,1.76400000012345600126e+09,1.76400000012345600126e+09,NULL,NULL,0.0,0.0,0.0,'[]','[]',NULL,0,0,0,'running',NULL,NULL,1,0,0,0,0,NULL,'auto',NULL,0,NULL,NULL,NULL,'{}','[]',12,1,NULL);
INSERT INTO "jobs" VALUES(2,'running-2rank','alice',1001,1001,'/home/alice/exp',1,2,6442450944,1,'RUNNING','ranks agreed',NULL,NULL,1.76400000012345600126e+09,1.76400000212345600125e+09,1.76400000212345600125e+09,NULL,123.25,61.625,0.5,'[0, 1]','[0, 1]',NULL,0,3221225472,1,'running',NULL,NULL,0,0,0,0,0,41,'auto','cooperative',1,NULL,NULL,NULL,'{}','[{"rank": 0, "pid": 4242, "state": "running", "connected": true, "device_bytes": 3221225472}, {"rank": 1, "pid": 4243, "state": "running", "connected": true, "device_bytes": 3221225472}]',36,2,NULL);
INSERT INTO "jobs" VALUES(3,'paused-ram','bob',1002,1002,'/home/alice/exp',1,1,6442450944,1,'PAUSED','parked in RAM at step 1200',NULL,NULL,1.76400000012345600126e+09,1.76400002212345600126e+09,1.76400000312345600129e+09,NULL,3600.0,3500.0,12.75,'[]','[1]','ram',5368709120,0,1,'paused','ram',1.76400002162345600131e+09,0,0,0,0,2,1200,'auto','cooperative',1,NULL,NULL,8589934592,'{"0": 1048576, "1": 4096}','[]',37,1,NULL);
INSERT INTO "jobs" VALUES(4,'paused-disk','alice',1001,1001,'/home/alice/exp',1,1,6442450944,1,'PAUSED','parked on disk',NULL,NULL,1.76400000012345600126e+09,1.7640000241234560013e+09,1.76400000412345600133e+09,NULL,0.0,0.0,0.0,'[]','[0]','disk',7516192768,0,1,'paused','disk',1.7640000231234560013e+09,0,0,0,0,0,77,'transparent','transparent',1,NULL,NULL,NULL,'{}','[]',27,1,'rank 1: NCCL communicator cannot be rebuilt');
INSERT INTO "jobs" VALUES(5,'stopped','alice',1001,1001,'/home/alice/exp',0,1,6442450944,1,'PAUSED','no gpuswap runtime: stopped (SIGSTOP)',NULL,NULL,1.76400000012345600126e+09,1.76400002512345600129e+09,1.76400000512345600132e+09,NULL,0.0,0.0,0.0,'[1]','[1]',NULL,0,0,1,'running',NULL,NULL,0,1,1,0,0,NULL,'auto',NULL,0,NULL,NULL,NULL,'{}','[]',28,1,NULL);
INSERT INTO "jobs" VALUES(6,'pausing','alice',1001,1001,'/home/alice/exp',1,1,6442450944,1,'PAUSING','pausing to ram: requested by user',NULL,NULL,1.76400000012345600126e+09,1.76400002612345600133e+09,1.76400000612345600123e+09,NULL,0.0,0.0,0.0,'[0]','[0]',NULL,0,0,1,'paused','ram',1.76400002612345600133e+09,0,0,0,0,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,'{}','[]',29,1,NULL);
INSERT INTO "jobs" VALUES(7,'resuming','alice',1001,1001,'/home/alice/exp',1,1,6442450944,1,'RESUMING','resuming on GPU 1',NULL,NULL,1.76400000012345600126e+09,1.76400002812345600127e+09,1.76400000712345600122e+09,NULL,0.0,0.0,0.0,'[1]','[1]','ram',1073741824,0,1,'running',NULL,NULL,0,0,0,0,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,'{}','[]',31,1,NULL);
INSERT INTO "jobs" VALUES(8,'completed','alice',1001,1001,'/home/alice/exp',1,1,6442450944,1,'COMPLETED','exited with code 0',0,NULL,1.76400000012345600126e+09,1.76400002912345600127e+09,1.76400000812345600126e+09,1.76400002912345600127e+09,1.0,1.0,0.0,'[]','[0]',NULL,0,0,1,'running',NULL,NULL,0,0,0,0,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,'{}','[]',38,1,NULL);
INSERT INTO "jobs" VALUES(9,'failed','alice',1001,1001,'/home/alice/exp',1,1,6442450944,0,'FAILED','killed by signal 9',NULL,9,1.76400000012345600126e+09,1.76400003012345600126e+09,1.7640000091234560013e+09,1.76400003012345600126e+09,0.0,0.0,0.0,'[]','[1]',NULL,0,0,1,'running',NULL,NULL,0,0,0,0,0,NULL,'cooperative','cooperative',1,'cuda-checkpoint: the job holds CUDA IPC memory','out of host memory while parking',NULL,'{}','[]',33,1,NULL);
INSERT INTO "jobs" VALUES(10,'cancelled','alice',1001,1001,'/home/alice/exp',1,1,6442450944,1,'CANCELLED','cancelled by alice',NULL,NULL,1.76400000012345600126e+09,1.7640000311234560013e+09,1.76400001012345600129e+09,1.7640000311234560013e+09,0.0,0.0,0.0,'[]','[0]',NULL,0,0,1,'running',NULL,NULL,0,0,0,1,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,'{}','[]',34,1,NULL);
CREATE TABLE tokens (
    id TEXT PRIMARY KEY,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    hash TEXT NOT NULL,
    created REAL NOT NULL,
    created_by TEXT NOT NULL,
    note TEXT NOT NULL DEFAULT ''
);
INSERT INTO "tokens" VALUES('a1b2c3','alice',1001,'0000000000000000000000000000000000000000000000000000000000000000',1.76400006312345600124e+09,'root','laptop');
INSERT INTO "tokens" VALUES('d4e5f6','bob',1002,'ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff',1.76400006412345600127e+09,'bob','');
CREATE TABLE usage (
    user TEXT PRIMARY KEY,
    gpu_s REAL NOT NULL,
    updated REAL NOT NULL
);
INSERT INTO "usage" VALUES('alice',9876.5,1.76400006012345600134e+09);
INSERT INTO "usage" VALUES('bob',0.125,1.76400006012345600134e+09);
CREATE INDEX jobs_version ON jobs(version);
CREATE INDEX jobs_state ON jobs(state);
CREATE INDEX jobs_user ON jobs(user);
CREATE INDEX events_job ON events(job_id);
CREATE INDEX decisions_job ON decisions(job_id);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('jobs',11);
INSERT INTO "sqlite_sequence" VALUES('events',35);
INSERT INTO "sqlite_sequence" VALUES('decisions',3);
COMMIT;

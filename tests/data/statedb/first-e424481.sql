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
    reason TEXT NOT NULL
);
INSERT INTO "events" VALUES(1,1,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(2,2,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(3,3,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(4,4,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(5,5,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(6,6,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(7,7,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(8,8,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(9,9,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(10,10,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(11,11,1.76400000012345600126e+09,'PENDING','submitted');
INSERT INTO "events" VALUES(12,2,1.76400000212345600125e+09,'RUNNING','started on GPU 0');
INSERT INTO "events" VALUES(13,3,1.76400000312345600129e+09,'RUNNING','started on GPU 1');
INSERT INTO "events" VALUES(14,4,1.76400000412345600133e+09,'RUNNING','started on GPU 0');
INSERT INTO "events" VALUES(15,5,1.76400000512345600132e+09,'RUNNING','started on GPU 1');
INSERT INTO "events" VALUES(16,6,1.76400000612345600123e+09,'RUNNING','started on GPU 0');
INSERT INTO "events" VALUES(17,7,1.76400000712345600122e+09,'RUNNING','started on GPU 1');
INSERT INTO "events" VALUES(18,8,1.76400000812345600126e+09,'RUNNING','started on GPU 0');
INSERT INTO "events" VALUES(19,9,1.7640000091234560013e+09,'RUNNING','started on GPU 1');
INSERT INTO "events" VALUES(20,10,1.76400001012345600129e+09,'RUNNING','started on GPU 0');
INSERT INTO "events" VALUES(21,11,1.76400001112345600129e+09,'RUNNING','started on GPU 1');
INSERT INTO "events" VALUES(22,2,1.76400002012345600123e+09,'RUNNING','ranks agreed');
INSERT INTO "events" VALUES(23,3,1.76400002112345600123e+09,'PAUSING','pausing to ram: the policy''s choice');
INSERT INTO "events" VALUES(24,3,1.76400002212345600126e+09,'PAUSED','parked in RAM at step 1200');
INSERT INTO "events" VALUES(25,4,1.7640000231234560013e+09,'PAUSING','pausing to disk: requested by user');
INSERT INTO "events" VALUES(26,4,1.7640000241234560013e+09,'PAUSED','parked on disk');
INSERT INTO "events" VALUES(27,5,1.76400002512345600129e+09,'PAUSED','no gpuswap runtime: stopped (SIGSTOP)');
INSERT INTO "events" VALUES(28,6,1.76400002612345600133e+09,'PAUSING','pausing to ram: requested by user');
INSERT INTO "events" VALUES(29,7,1.76400002712345600123e+09,'PAUSED','pausing to ram');
INSERT INTO "events" VALUES(30,7,1.76400002812345600127e+09,'RESUMING','resuming on GPU 1');
INSERT INTO "events" VALUES(31,8,1.76400002912345600127e+09,'COMPLETED','exited with code 0');
INSERT INTO "events" VALUES(32,9,1.76400003012345600126e+09,'FAILED','killed by signal 9');
INSERT INTO "events" VALUES(33,10,1.7640000311234560013e+09,'CANCELLED','cancelled by alice');
INSERT INTO "events" VALUES(34,11,1.76400003212345600133e+09,'COMPLETED','exited with code 0');
CREATE TABLE jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    user TEXT NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    argv TEXT NOT NULL,
    cwd TEXT NOT NULL,
    env TEXT NOT NULL,
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
    version INTEGER NOT NULL DEFAULT 0
);
INSERT INTO "jobs" VALUES(1,'queued','alice',1001,1001,'["python", "train.py", "--lr", "3e-4", "h\u00e9llo w\u00f6rld \u2713", "a\nb", "it''s"]','/home/alice/exp','{"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "NOTE": "\u00fcn\u00efcode \u2713"}',3,1,6442450944,1,'PENDING','held by alice',NULL,NULL,1.76400000012345600126e+09,1.76400000012345600126e+09,NULL,NULL,0.0,0.0,0.0,'[]','[]',NULL,0,0,0,'running',NULL,NULL,1,0,0,0,0,NULL,'auto',NULL,0,NULL,NULL,NULL,12);
INSERT INTO "jobs" VALUES(2,'running-2rank','alice',1001,1001,'["torchrun", "--nproc-per-node", "2", "ddp.py"]','/home/alice/exp','{"PATH": "/usr/bin"}',1,2,6442450944,1,'RUNNING','ranks agreed',NULL,NULL,1.76400000012345600126e+09,1.76400000212345600125e+09,1.76400000212345600125e+09,NULL,123.25,61.625,0.5,'[0, 1]','[0, 1]',NULL,0,3221225472,1,'running',NULL,NULL,0,0,0,0,0,41,'auto','cooperative',1,NULL,NULL,NULL,36);
INSERT INTO "jobs" VALUES(3,'paused-ram','bob',1002,1002,'["python", "a.py"]','/home/alice/exp','{"SEED": "1"}',1,1,6442450944,1,'PAUSED','parked in RAM at step 1200',NULL,NULL,1.76400000012345600126e+09,1.76400002212345600126e+09,1.76400000312345600129e+09,NULL,3600.0,3500.0,12.75,'[]','[1]','ram',5368709120,0,1,'paused','ram',1.76400002162345600131e+09,0,0,0,0,2,1200,'auto','cooperative',1,NULL,NULL,8589934592,37);
INSERT INTO "jobs" VALUES(4,'paused-disk','alice',1001,1001,'["python", "b.py"]','/home/alice/exp','{}',1,1,6442450944,1,'PAUSED','parked on disk',NULL,NULL,1.76400000012345600126e+09,1.7640000241234560013e+09,1.76400000412345600133e+09,NULL,0.0,0.0,0.0,'[]','[0]','disk',7516192768,0,1,'paused','disk',1.7640000231234560013e+09,0,0,0,0,0,77,'transparent','transparent',1,NULL,NULL,NULL,27);
INSERT INTO "jobs" VALUES(5,'stopped','alice',1001,1001,'["./legacy.sh"]','/home/alice/exp','{"X": "1"}',0,1,6442450944,1,'PAUSED','no gpuswap runtime: stopped (SIGSTOP)',NULL,NULL,1.76400000012345600126e+09,1.76400002512345600129e+09,1.76400000512345600132e+09,NULL,0.0,0.0,0.0,'[1]','[1]',NULL,0,0,1,'running',NULL,NULL,0,1,1,0,0,NULL,'auto',NULL,0,NULL,NULL,NULL,28);
INSERT INTO "jobs" VALUES(6,'pausing','alice',1001,1001,'["python", "c.py"]','/home/alice/exp','{}',1,1,6442450944,1,'PAUSING','pausing to ram: requested by user',NULL,NULL,1.76400000012345600126e+09,1.76400002612345600133e+09,1.76400000612345600123e+09,NULL,0.0,0.0,0.0,'[0]','[0]',NULL,0,0,1,'paused','ram',1.76400002612345600133e+09,0,0,0,0,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,29);
INSERT INTO "jobs" VALUES(7,'resuming','alice',1001,1001,'["python", "d.py"]','/home/alice/exp','{}',1,1,6442450944,1,'RESUMING','resuming on GPU 1',NULL,NULL,1.76400000012345600126e+09,1.76400002812345600127e+09,1.76400000712345600122e+09,NULL,0.0,0.0,0.0,'[1]','[1]','ram',1073741824,0,1,'running',NULL,NULL,0,0,0,0,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,31);
INSERT INTO "jobs" VALUES(8,'completed','alice',1001,1001,'["true"]','/home/alice/exp','{"SECRET": "gone-when-ended"}',1,1,6442450944,1,'COMPLETED','exited with code 0',0,NULL,1.76400000012345600126e+09,1.76400002912345600127e+09,1.76400000812345600126e+09,1.76400002912345600127e+09,1.0,1.0,0.0,'[]','[0]',NULL,0,0,1,'running',NULL,NULL,0,0,0,0,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,38);
INSERT INTO "jobs" VALUES(9,'failed','alice',1001,1001,'["python", "oom.py"]','/home/alice/exp','{}',1,1,6442450944,0,'FAILED','killed by signal 9',NULL,9,1.76400000012345600126e+09,1.76400003012345600126e+09,1.7640000091234560013e+09,1.76400003012345600126e+09,0.0,0.0,0.0,'[]','[1]',NULL,0,0,1,'running',NULL,NULL,0,0,0,0,0,NULL,'cooperative','cooperative',1,'cuda-checkpoint: the job holds CUDA IPC memory','out of host memory while parking',NULL,33);
INSERT INTO "jobs" VALUES(10,'cancelled','alice',1001,1001,'["sleep", "1000"]','/home/alice/exp','{}',1,1,6442450944,1,'CANCELLED','cancelled by alice',NULL,NULL,1.76400000012345600126e+09,1.7640000311234560013e+09,1.76400001012345600129e+09,1.7640000311234560013e+09,0.0,0.0,0.0,'[]','[0]',NULL,0,0,1,'running',NULL,NULL,0,0,0,1,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,34);
INSERT INTO "jobs" VALUES(11,'forgotten','alice',1001,1001,'["true"]','/home/alice/exp','{}',1,1,6442450944,1,'COMPLETED','exited with code 0',0,NULL,1.76400000012345600126e+09,1.76400003212345600133e+09,1.76400001112345600129e+09,1.76400003212345600133e+09,0.0,0.0,0.0,'[]','[1]',NULL,0,0,1,'running',NULL,NULL,0,0,0,0,0,NULL,'auto','cooperative',1,NULL,NULL,NULL,35);
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
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('jobs',11);
INSERT INTO "sqlite_sequence" VALUES('events',34);
INSERT INTO "sqlite_sequence" VALUES('decisions',3);
COMMIT;

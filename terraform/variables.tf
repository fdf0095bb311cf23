# The deployment's knobs. What runs where comes from ../regions.yaml; these say how big
# and on what. The schemas of region_settings, model_settings and defaults are in
# modules/topology/variables.tf.

variable "project_id" {
  description = "The Google Cloud project to deploy into."
  type        = string
}

variable "domain" {
  description = "The API's host name, e.g. llm.example.com (a managed TLS certificate is issued for it)."
  type        = string
}

variable "globalpool_pip_spec" {
  description = "What pip installs on routers and workers, e.g. \"globalpool @ git+https://github.com/<org>/globalpool@v0.1.0\" or a wheel URL; its dependencies are installed at the versions of ../requirements.lock."
  type        = string
}

variable "vllm_pip_spec" {
  description = "What pip installs on GPU machines (its own virtual environment)."
  type        = string
  default     = "vllm==0.32.0"
}

variable "regions_yaml_path" {
  description = "The regions.yaml to deploy (the one `globalpool up` runs)."
  type        = string
  default     = null
}

variable "name_prefix" {
  description = "Prefix of every resource name (two deployments in one project need two prefixes)."
  type        = string
  default     = "gp"
}

variable "model_settings" {
  description = "Per model name of regions.yaml: { source = \"<HF repo>\", vllm_args, max_num_seqs, replicas, machine_type, gpu_type, gpu_count, disk_gb }."
  type        = any
  default     = {}
}

variable "region_settings" {
  description = "Per region of regions.yaml: { cloud_region, zones, subnet_cidr, router_replicas (the autoscaler's minimum), router_max_replicas, router_machine_type, redis_zone, redis_machine_type, gpu_pools = { <model> = { replicas, machine_type, gpu_type, gpu_count, spot } } }."
  type        = any
  default     = {}
}

variable "defaults" {
  description = "Sizes used where region_settings and model_settings say nothing (see modules/topology/variables.tf)."
  type        = any
  default     = {}
}

variable "redis_primary_region" {
  description = "The region whose Redis node is the primary when the deployment first starts (default: regions.yaml router.region). Failover is automatic (Redis Sentinel) and changing this later moves nothing: it only names the initial primary (kept for compatibility)."
  type        = string
  default     = null
}

variable "dns_zone_name" {
  description = "A public Cloud DNS zone holding the domain, to create its A record; null: create it yourself."
  type        = string
  default     = null
}

variable "gpu_image" {
  description = "Boot image of GPU machines: Deep Learning VM (NVIDIA driver, CUDA 12.9, Ubuntu 24.04 with Python 3.12)."
  type        = string
  default     = "projects/deeplearning-platform-release/global/images/family/common-cu129-ubuntu-2404-nvidia-580"
}

variable "base_image" {
  description = "Boot image of routers and Redis nodes."
  type        = string
  default     = "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64"
}

variable "enable_iap_ssh" {
  description = "Allow SSH to the machines through Identity-Aware Proxy only."
  type        = bool
  default     = true
}

variable "ops_agent" {
  description = "Install the Ops Agent on every machine (logs and metrics in Cloud Logging/Monitoring)."
  type        = bool
  default     = true
}

variable "files_location" {
  description = "Location of the bucket that holds the Files and Batch APIs' files (a multi-region such as US or EU, a dual-region such as NAM4, or a region); null: the multi-region of the home region's continent (US, EU or ASIA; elsewhere the home region), the home region being redis_primary_region's. Read when the bucket is created only: a bucket cannot move, so a later change leaves it where it is."
  type        = string
  default     = null
}

variable "files_retention_days" {
  description = "Days after which uploaded files and batch results are deleted from the bucket (a lifecycle rule), so that they do not pile up; at least 2."
  type        = number
  default     = 30
}

variable "files_kms_key_name" {
  description = "A Cloud KMS key (projects/P/locations/L/keyRings/R/cryptoKeys/K, in the bucket's location) to encrypt the bucket's objects with; Cloud Storage's service agent is granted its use. null: Google-managed keys."
  type        = string
  default     = null
}

variable "labels" {
  description = "Labels on every machine and secret, and on the files bucket."
  type        = map(string)
  default     = {}
}

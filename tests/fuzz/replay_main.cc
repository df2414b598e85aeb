// Replays inputs through a harness without libFuzzer: the main() the normal test
// suite links each harness with (tests/fuzz/test_corpus_replay.py builds it with
// g++). Arguments are files or folders (every file in them, not recursing);
// each is read whole and passed to LLVMFuzzerTestOneInput once. A crash, an
// abort or an escaping exception ends the process; the input is named on stderr
// first, so the failing file is known.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool replay(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "replay: cannot read %s\n", path.c_str());
    return false;
  }
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  std::fprintf(stderr, "replay: %s (%zu bytes)\n", path.c_str(), bytes.size());
  // A copy of exactly the input's size, so a read past its end is an over-read
  // the sanitizer sees (the vector's data() may have spare capacity).
  std::unique_ptr<uint8_t[]> exact(new uint8_t[bytes.size() == 0 ? 1 : bytes.size()]);
  std::copy(bytes.begin(), bytes.end(), exact.get());
  LLVMFuzzerTestOneInput(exact.get(), bytes.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  size_t replayed = 0;
  for (int i = 1; i < argc; ++i) {
    struct stat info{};
    if (::stat(argv[i], &info) != 0) {
      std::fprintf(stderr, "replay: no such file or folder: %s\n", argv[i]);
      return 2;
    }
    std::vector<std::string> files;
    if (S_ISDIR(info.st_mode)) {
      DIR* dir = ::opendir(argv[i]);
      if (dir == nullptr) return 2;
      while (dirent* entry = ::readdir(dir)) {
        const std::string path = std::string(argv[i]) + "/" + entry->d_name;
        struct stat file{};
        if (::stat(path.c_str(), &file) == 0 && S_ISREG(file.st_mode)) files.push_back(path);
      }
      ::closedir(dir);
    } else {
      files.push_back(argv[i]);
    }
    for (const std::string& path : files) {
      if (!replay(path)) return 2;
      ++replayed;
    }
  }
  std::printf("replayed %zu inputs\n", replayed);
  return 0;
}
